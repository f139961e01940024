// A plain-text table for people: columns padded to their widest cell.
#ifndef PIPPY_CLIENT_TABLE_H_
#define PIPPY_CLIENT_TABLE_H_

#include <string>
#include <vector>

namespace pippy::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_TABLE_H_
