"""Finds CUDA and NCCL on this machine (CUDA_HOME, default /usr/local/cuda).

Creates @local_cuda with:
  :cuda      headers (symlinked from CUDA_HOME/include) and -lcudart -lnccl, or empty
  defs.bzl   CUDA_FOUND = True/False
Build with --define=pippy_cuda=off to leave GPU code out even where CUDA is found.
"""

def _impl(ctx):
    root = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    needed = ["/include/nccl.h", "/include/cuda_runtime.h", "/lib64/libnccl.so", "/lib64/libcudart.so"]
    found = all([ctx.path(root + p).exists for p in needed])
    if found:
        ctx.symlink(root + "/include", "include")
        ctx.file("BUILD", """
cc_library(
    name = "cuda",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    linkopts = ["-L{root}/lib64", "-Wl,-rpath,{root}/lib64", "-lnccl", "-lcudart"],
    visibility = ["//visibility:public"],
)
""".format(root = root))
    else:
        ctx.file("BUILD", 'cc_library(name = "cuda", visibility = ["//visibility:public"])\n')
    ctx.file("defs.bzl", "CUDA_FOUND = %s\nCUDA_ROOT = %r\n" % (found, root))

cuda_configure = repository_rule(
    implementation = _impl,
    environ = ["CUDA_HOME"],
    local = True,
)
