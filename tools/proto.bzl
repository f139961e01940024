"""Protocol Buffers for C++ with Debian's protoc and grpc_cpp_plugin (no downloads)."""

def pippy_proto_library(name, srcs, deps = [], grpc = False, visibility = None):
    """Generates <name> (cc_library) from .proto files in this package.

    Args:
      name: the cc_library's name.
      srcs: .proto files of this package; imports are relative to the workspace root.
      deps: other pippy_proto_library targets whose .proto files these import.
      grpc: also generate gRPC service stubs (*.grpc.pb.{h,cc}).
      visibility: visibility of the cc_library.
    """
    pkg = native.package_name()
    bases = [s[:-len(".proto")] for s in srcs]
    outs = [b + ".pb.h" for b in bases] + [b + ".pb.cc" for b in bases]
    if grpc:
        outs += [b + ".grpc.pb.h" for b in bases] + [b + ".grpc.pb.cc" for b in bases]
    dep_protos = [d + "_srcs" for d in deps]
    native.filegroup(name = name + "_srcs", srcs = srcs + dep_protos, visibility = visibility)
    cmd = "/usr/bin/protoc -I. --cpp_out=$(GENDIR) "
    if grpc:
        cmd += "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin "
    cmd += " ".join(["%s/%s" % (pkg, s) for s in srcs])
    native.genrule(
        name = name + "_gen",
        srcs = srcs + dep_protos,
        outs = outs,
        cmd = cmd,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:grpc" if grpc else "//third_party:protobuf"],
        visibility = visibility,
    )
