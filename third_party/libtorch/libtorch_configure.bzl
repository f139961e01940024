"""LibTorch for the build: Debian's (the default) or the one PIPPY_LIBTORCH names.

PIPPY_LIBTORCH=DIR: a LibTorch with DIR/include (with torch/script.h and torch/csrc/api/include)
and DIR/lib, e.g. the `torch` Python package's folder (python3 -c 'import torch, os;
print(os.path.dirname(torch.__file__))'). Its libtorch_cuda is linked where it has one
(so that stages can run on GPUs), with --no-as-needed: nothing refers to its symbols, and
without it LibTorch finds no CUDA. The library must use the C++11 string ABI, like
Debian's gRPC and Abseil (PyTorch's wheels do from 2.7 on).

Creates @local_libtorch with :torch, and defs.bzl with LIBTORCH (the folder, or "" for
Debian's) and LIBTORCH_CUDA.
"""

def _impl(ctx):
    root = ctx.os.environ.get("PIPPY_LIBTORCH", "")
    if not root:
        ctx.file("BUILD", """
# Debian's LibTorch: headers under /usr/include (the API folder is added in .bazelrc).
cc_library(
    name = "torch",
    linkopts = ["-ltorch", "-ltorch_cpu", "-lc10", "-lpthread"],
    visibility = ["//visibility:public"],
)
""")
        ctx.file("defs.bzl", "LIBTORCH = \"\"\nLIBTORCH_CUDA = False\n")
        return
    for need in ["/include/torch/script.h", "/include/torch/csrc/api/include/torch/all.h", "/lib/libtorch_cpu.so", "/lib/libc10.so"]:
        if not ctx.path(root + need).exists:
            fail("PIPPY_LIBTORCH=%s: %s is missing; name a LibTorch folder with include/ and lib/ (the torch " % (root, root + need) +
                 "package's folder: python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')")
    cuda = ctx.path(root + "/lib/libtorch_cuda.so").exists
    ctx.symlink(root + "/include", "include")
    libs = ["-ltorch", "-ltorch_cpu", "-lc10"] + (["-ltorch_cuda", "-lc10_cuda"] if cuda else [])
    linkopts = ["-L%s/lib" % root, "-Wl,-rpath,%s/lib" % root, "-Wl,--no-as-needed"] + libs + ["-Wl,--as-needed", "-lpthread"]
    ctx.file("BUILD", """
cc_library(
    name = "torch",
    hdrs = glob(["include/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    linkopts = {linkopts},
    visibility = ["//visibility:public"],
)
""".format(linkopts = repr(linkopts)))
    ctx.file("defs.bzl", "LIBTORCH = %r\nLIBTORCH_CUDA = %s\n" % (root, cuda))

libtorch_configure = repository_rule(
    implementation = _impl,
    environ = ["PIPPY_LIBTORCH"],
    local = True,
)
