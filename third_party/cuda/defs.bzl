"""The choice every piece of pippy's GPU code makes between its CUDA files and its stubs."""

load("@local_cuda//:defs.bzl", "CUDA_FOUND")

def if_cuda(with_cuda, without_cuda = []):
    """`with_cuda` where CUDA and NCCL are found (cuda_configure.bzl) and the build does
    not say --define=pippy_cuda=off; `without_cuda` otherwise."""
    if not CUDA_FOUND:
        return without_cuda
    return select({
        "//third_party/cuda:cuda_off": without_cuda,
        "//conditions:default": with_cuda,
    })
