"""The bytes of a Kineto trace file, decompressed chunk by chunk, with warnings instead of exceptions.

A plain file is read in CHUNK_BYTES blocks. A gzip file that is one whole member (what the profiler writes) of at
most WHOLE_GUNZIP_BYTES is inflated by libdeflate in one call (three times zlib's speed, without the GIL: the time a
worker process spends per rank); any other (a stream cut short, damaged, concatenated members, zero padding, larger)
is inflated by zlib, which yields everything before a cut and reads through members and padding, or, above
THREAD_GUNZIP_BYTES and where the optional C extension _kinflate.c is built, by a second thread that never takes
the GIL. Damage gives the bytes before it and one warning naming the compressed offset.
"""
from __future__ import annotations

import ctypes
import os
import zlib
from typing import Any, Callable, Iterator

import deflate._deflate


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


# LAYOUTLAB_KINETO_PURE=1 turns the compiled paths off: libdeflate's one call, the C inflater and the C scanner
# (analysis.parsers.kineto).
PURE = os.environ.get("LAYOUTLAB_KINETO_PURE", "") not in ("", "0")
_libdeflate: Any = None if PURE else _Libdeflate(deflate._deflate.__file__)
# The C inflater (analysis/parsers/_kinflate.c, built by `pip install`, optional).
_kinflate: Any = None
if not PURE:
    try:
        from analysis.parsers import _kinflate
    except ImportError:
        _kinflate = None

CHUNK_BYTES = 1 << 20          # decompressed bytes handed to the decoder at a time
_RAW_READ_BYTES = 1 << 16       # compressed bytes read at a time
WHOLE_GUNZIP_BYTES = 1 << 28  # one-member gzip files inflating to at most this are inflated in one call (libdeflate)
THREAD_GUNZIP_BYTES = 1 << 18  # gzip files larger than this are inflated by a second thread (_kinflate)
_GUNZIP_AHEAD = 4               # decompressed chunks it may run ahead


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
                if _kinflate is not None and os.fstat(fh.fileno()).st_size > THREAD_GUNZIP_BYTES:
                    yield from self._gunzip_in_thread(fh)
                else:
                    yield from self._gunzip(fh, self.warn)
            else:
                while block := fh.read(CHUNK_BYTES):
                    yield block

    def _gunzip(self, fh, warn: Callable[[str], None]) -> Iterator[bytes]:
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
                    warn(f"{self.name}: gzip data corrupt after compressed byte {fed} ({exc}); the events before "
                         f"the damage are kept, which lies within the last {self.size - fed:,} compressed bytes")
                    return
                if out:
                    yield out
                data = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
            fed += len(raw)
        if not inflater.eof:
            warn(f"{self.name}: gzip stream ends early at compressed byte {fed} "
                 f"(file cut short, e.g. by a crashed run); the events before the cut are kept")

    def _gunzip_in_thread(self, fh) -> Iterator[bytes]:
        """_gunzip done by _kinflate.Reader in a second thread that never takes the GIL, a few chunks
        ahead of the scanning (inflation is a third of the time of a gzipped trace otherwise). The
        warnings are _gunzip's; on corrupt data the output up to the failure is kept (zlib's
        decompressobj drops the output of the call that fails)."""
        import threading

        reader = _kinflate.Reader(fh.fileno(), CHUNK_BYTES, _GUNZIP_AHEAD)
        worker = threading.Thread(target=reader.run, name="kineto-gunzip", daemon=True)
        worker.start()
        try:
            while (block := reader.next()) is not None:
                yield block
        finally:
            reader.close()
            worker.join()
        status, code, message, fed, errno = reader.outcome()
        if status == 1:
            self.warn(f"{self.name}: gzip stream ends early at compressed byte {fed} "
                      f"(file cut short, e.g. by a crashed run); the events before the cut are kept")
        elif status == 2:
            self.warn(f"{self.name}: gzip data corrupt after compressed byte {fed} (Error {code} while "
                      f"decompressing data: {message}); the events before the damage are kept, "
                      f"which lies within the last {self.size - fed:,} compressed bytes")
        elif status == 3:
            self.warn(f"{self.name}: cannot read after compressed byte {fed} ({os.strerror(errno)})")


def _gunzip_whole(fh) -> bytearray | None:
    """The file inflated by libdeflate in one call where it is one undamaged gzip member of at most
    WHOLE_GUNZIP_BYTES, else None (the streaming readers then give what it holds, with their warnings): a cut, damage,
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
