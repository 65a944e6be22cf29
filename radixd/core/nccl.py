"""NCCL through ctypes: a communicator per shard thread of one process.

``torch.cuda.nccl.init_rank`` fails on Python 3.12 (its argument parsing predates
``PY_SSIZE_T_CLEAN``), and ``torch.distributed`` wants one process per rank, so tensor
parallelism in one process calls the library torch already loaded directly: the unique id is
made once, each shard's thread joins with its rank (``ncclCommInitRank`` blocks until all
have), and each all-reduce is queued on the calling thread's current CUDA stream, so the
shards' threads queue their layers independently (and CUDA graphs can capture them).
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_DTYPES = {torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_SUM = 0


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _find_library() -> ctypes.CDLL:
    """The NCCL that torch loaded (same soname, so the same handle), else the pip package's."""
    candidates = ["libnccl.so.2"]
    try:
        import nvidia.nccl  # the pip wheel torch depends on

        for base in nvidia.nccl.__path__:
            candidates += sorted(glob.glob(os.path.join(base, "lib", "libnccl.so*")))
    except ImportError:
        pass
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise RuntimeError("NCCL library not found (tensor parallelism on CUDA needs it): " + "; ".join(errors))


class Nccl:
    def __init__(self):
        lib = _find_library()
        self.lib = lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: NCCL error {result}: {self.lib.ncclGetErrorString(result).decode()}")

    def unique_id(self) -> UniqueId:
        uid = UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def init_rank(self, nranks: int, uid: UniqueId, rank: int) -> Communicator:
        """Join the communicator as ``rank``, on the current CUDA device (blocks for all)."""
        comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank), "ncclCommInitRank")
        return Communicator(self, comm)


class Communicator:
    def __init__(self, nccl: Nccl, comm: ctypes.c_void_p):
        self.nccl = nccl
        self.comm = comm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place, on the current stream (``t`` contiguous)."""
        if not t.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor")
        stream = torch.cuda.current_stream(t.device).cuda_stream
        self.nccl._check(self.nccl.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), _DTYPES[t.dtype], _SUM,
                                                     self.comm, ctypes.c_void_p(stream)), "ncclAllReduce")
        return t

    def all_gather(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` into ``out`` (``[nranks, *t.shape]``), on the current stream."""
        if not (t.is_contiguous() and out.is_contiguous()):
            raise ValueError("all_gather needs contiguous tensors")
        stream = torch.cuda.current_stream(t.device).cuda_stream
        self.nccl._check(self.nccl.lib.ncclAllGather(t.data_ptr(), out.data_ptr(), t.numel(), _DTYPES[t.dtype],
                                                     self.comm, ctypes.c_void_p(stream)), "ncclAllGather")
        return out

    def close(self) -> None:
        if self.comm:
            self.nccl.lib.ncclCommDestroy(self.comm)
            self.comm = ctypes.c_void_p()
