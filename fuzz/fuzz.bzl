"""libFuzzer targets built with Debian's clang from genrules.

Bazel 4.2.3 configures one C++ toolchain (GCC) for the whole build; a second one for
some targets needs platforms and transitions this offline setup does not have. So each
source file is compiled by its own genrule (cached and run in parallel like any action)
with clang, AddressSanitizer, UndefinedBehaviorSanitizer and libFuzzer's instrumentation (fuzz/clang_fuzz.sh), and
each fuzz target is linked by another.
"""

def _object_name(src):
    # "//pipeline/partition:model_io.cc" -> "pipeline_partition_model_io"
    label = src.lstrip("/").replace(":", "/")
    return label[:label.rfind(".")].replace("/", "_")

def fuzz_objects(srcs, hdrs):
    """One genrule per source: obj/<path>.o. Returns {src: object label}."""
    objects = {}
    for src in srcs:
        name = "obj_" + _object_name(src)
        native.genrule(
            name = name,
            srcs = [src] + hdrs,
            outs = ["obj/%s.o" % _object_name(src)],
            tools = [":clang_fuzz.sh"],
            cmd = "$(location :clang_fuzz.sh) compile $(GENDIR) $(location %s) $@" % src,
        )
        objects[src] = ":" + name
    return objects

def fuzz_target(name, objects):
    """Links the fuzz target `name` (a binary in this package) from object labels."""
    native.genrule(
        name = name,
        srcs = objects,
        outs = ["bin/" + name],
        tools = [":clang_fuzz.sh"],
        cmd = "$(location :clang_fuzz.sh) link $@ $(SRCS)",
        executable = True,
    )
