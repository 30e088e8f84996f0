"""The bytes of a Kineto trace file, decompressed chunk by chunk, with warnings instead of exceptions.

A plain file is read in CHUNK_BYTES blocks. A gzip file that is one whole member (what the profiler writes) of at most
WHOLE_GUNZIP_BYTES (32 MiB) is inflated by libdeflate in one call (a third of zlib's time where a worker process
reuses the output's pages, from one to the next rank: the time it spends per rank). Any other (a stream cut short,
damaged, concatenated members, zero padding, larger), and every gzip file where libdeflate cannot be loaded, streams
through zlib, which yields everything before a cut and reads through members and padding. Damage gives the bytes
before it and one warning naming the compressed offset.
"""
from __future__ import annotations

import ctypes
import os
import zlib
from typing import Callable, Iterator


class _Libdeflate:
    """libdeflate's C API as the deflate wheel builds and exports it (deflate/_deflate.abi3.so), called through ctypes,
    which releases the GIL for the call. Not the package's gzip_decompress: that inflates the first member and says
    nothing of what followed it, while a file is one member only when the member took every byte."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self._alloc = lib.libdeflate_alloc_decompressor
        self._alloc.restype, self._alloc.argtypes = ctypes.c_void_p, []
        self._free = lib.libdeflate_free_decompressor
        self._free.restype, self._free.argtypes = None, [ctypes.c_void_p]
        self._inflate = lib.libdeflate_gzip_decompress_ex
        self._inflate.restype = ctypes.c_int
        self._inflate.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]

    def one_member(self, raw: bytes, size: int) -> bytearray | None:
        """`raw` inflated where it is exactly one gzip member of `size` bytes, its CRC and length checked by libdeflate;
        else None. Into a bytearray: the allocator hands the next trace the same pages (fresh anonymous memory for each
        trace measured 2.5x slower, its pages faulted in one by one)."""
        out = bytearray(size)
        used, made = ctypes.c_size_t(), ctypes.c_size_t()
        decompressor = self._alloc()
        if not decompressor:
            return None
        try:
            status = self._inflate(decompressor, raw, len(raw), (ctypes.c_char * size).from_buffer(out), size,
                                   ctypes.byref(used), ctypes.byref(made))
        finally:
            self._free(decompressor)
        return out if status == 0 and used.value == len(raw) and made.value == size else None  # 0: LIBDEFLATE_SUCCESS


def _load_libdeflate() -> _Libdeflate | None:
    """libdeflate from the deflate wheel; None where the package cannot be imported, its library cannot be loaded or
    lacks a symbol (its exports are not the package's API): every gzip file then streams through zlib, the same
    bytes."""
    try:
        from deflate import _deflate

        return _Libdeflate(_deflate.__file__)
    except (ImportError, OSError, AttributeError):
        return None


# LAYOUTLAB_KINETO_PURE=1 turns the compiled paths off: libdeflate's one call and the C scanner
# (analysis.parsers.kineto).
PURE = os.environ.get("LAYOUTLAB_KINETO_PURE", "") not in ("", "0")
_libdeflate = None if PURE else _load_libdeflate()

CHUNK_BYTES = 1 << 20          # decompressed bytes handed to the decoder at a time
_RAW_READ_BYTES = 1 << 16       # compressed bytes read at a time
# One-member gzip files inflating to at most this are inflated in one call (libdeflate). glibc serves a larger block
# with fresh pages from mmap every time, never reused: faulting them in and scanning text no longer in cache made
# libdeflate's one call 10% slower than zlib's stream on 62 MiB of JSON, and 9% faster where the pages were reused.
WHOLE_GUNZIP_BYTES = 32 << 20


class Source:
    """Decompressed bytes of a file, chunk by chunk, with warnings instead of exceptions."""

    def __init__(self, path: str | os.PathLike[str], name: str, warn: Callable[[str], None]):
        self.path, self.name, self.warn = path, name, warn
        self.gzip = False
        self.failed = False
        self.size = 0

    def chunks(self) -> Iterator[bytes]:
        try:
            fh = open(self.path, "rb")
        except OSError as exc:
            self.failed = True
            self.warn(f"{self.name}: cannot read ({exc.strerror or exc})")
            return
        with fh:
            self.size = os.fstat(fh.fileno()).st_size
            head = fh.read(2)
            fh.seek(0)
            if head == b"\x1f\x8b":
                self.gzip = True
                whole = None if _libdeflate is None else _gunzip_whole(fh)
                if whole is not None:
                    for start in range(0, len(whole), CHUNK_BYTES):
                        yield whole[start:start + CHUNK_BYTES]
                    return
                fh.seek(0)
                yield from self._gunzip(fh)
            else:
                while block := fh.read(CHUNK_BYTES):
                    yield block

    def _gunzip(self, fh) -> Iterator[bytes]:
        # zlib rather than gzip.GzipFile: a cut-short stream still yields everything before the
        # cut, and the compressed offset of the failure is known.
        inflater = zlib.decompressobj(31)
        fed = 0
        while raw := fh.read(_RAW_READ_BYTES):
            data = raw
            while data:
                if inflater.eof:
                    if not data.strip(b"\0"):
                        break  # zero padding after the last member
                    inflater = zlib.decompressobj(31)  # concatenated gzip members
                before = inflater.copy()
                try:
                    out = inflater.decompress(data, CHUNK_BYTES)
                except zlib.error as exc:
                    # decompressobj drops the output of the call that fails: inflate the same bytes again, a few
                    # at a time, from the state before it, and keep what precedes the damage (a failed check of
                    # the trailer loses nothing).
                    yield from _inflate_until_damage(before, data)
                    self.warn(f"{self.name}: gzip data corrupt after compressed byte {fed} ({exc}); the events "
                              f"before the damage are kept, which lies within the last {self.size - fed:,} "
                              f"compressed bytes")
                    return
                if out:
                    yield out
                data = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
            fed += len(raw)
        if not inflater.eof:
            self.warn(f"{self.name}: gzip stream ends early at compressed byte {fed} "
                      f"(file cut short, e.g. by a crashed run); the events before the cut are kept")


def _gunzip_whole(fh) -> bytearray | None:
    """The file inflated by libdeflate in one call where it is one undamaged gzip member of at most
    WHOLE_GUNZIP_BYTES, else None (zlib's stream then gives what it holds, with its warnings): a cut, damage,
    a second member, padding or anything after the member all leave input unconsumed or fail the member's own check."""
    if os.fstat(fh.fileno()).st_size > WHOLE_GUNZIP_BYTES:
        return None
    raw = fh.read()
    if len(raw) < 18:  # a gzip header and trailer alone take 18 bytes
        return None
    size = int.from_bytes(raw[-4:], "little")  # the trailer's length: the member's, if the file is one member
    return _libdeflate.one_member(raw, size) if 0 < size <= WHOLE_GUNZIP_BYTES else None


def _inflate_until_damage(inflater, data: bytes, piece: int = 64) -> Iterator[bytes]:
    """Everything `inflater` (a copy taken before a failed call) gives for `data` up to the damage."""
    for i in range(0, len(data), piece):
        before = inflater.copy()
        try:
            out = inflater.decompress(data[i:i + piece])
        except zlib.error:
            if piece > 1:
                yield from _inflate_until_damage(before, data[i:i + piece], 1)
            return
        if out:
            yield out
