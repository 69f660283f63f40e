"""Reading plain, gzip, zstd and xz files through one reader that notices when a file is cut short.

The format comes from the file's first bytes, so a misnamed file still reads; a compression suffix
(``.gz``, ``.zst``, ``.zstd``, ``.xz``) on a file that does not start like one is an error. Multi-member
gzip, multi-stream xz and multi-frame zstd (pzstd, concatenated archives) are read to the end.

Every failure is a :class:`DataError` naming the file: a compressed stream that stops before its end
marker (an interrupted download or copy) is *truncated*, bytes the decompressor rejects are
*corrupt*, and a compressed file of 0 bytes or one that decompresses to nothing is *empty*. Plain
files carry no end marker, so only their emptiness is visible; a plain 0-byte file reads as nothing
(an empty ``__init__.py`` in a glob of sources is ordinary) and callers decide whether that matters.
"""

from __future__ import annotations

import gzip
import io
import lzma
import os
import zlib
from collections.abc import Generator

import zstandard

from gptj_flax.data.errors import DataError

SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".xz": "xz"}
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"))
# Compressed bytes per read: bounds one read's output by the compression ratio.
RAW_READ_BYTES = 1 << 16
DECOMPRESSED_BLOCK_BYTES = 1 << 20
# The most of a zstd file read back to tell a cut frame from garbage (see _zstd_cut_inside_a_block).
ZSTD_HEAD_BYTES = 1 << 20


class _NotZstd(ValueError):
    """Bytes after a zstd magic number that the decompressor accepted but no zstd compressor writes."""


_DECOMPRESSION_ERRORS = (OSError, zlib.error, lzma.LZMAError, zstandard.ZstdError, _NotZstd)


def strip_suffix(name: str) -> str:
    """``name`` without a trailing compression suffix (``a.jsonl.zst`` → ``a.jsonl``)."""
    root, suffix = os.path.splitext(name)
    return root if suffix.lower() in SUFFIXES else name


def claimed_format(name: str) -> str | None:
    """The compression a file's name claims, or None."""
    return SUFFIXES.get(os.path.splitext(name)[1].lower())


class DecompressedFile(io.RawIOBase):
    """A compressed (or plain) file's content, read forward once; see :func:`open_decompressed`."""

    def __init__(self, path: str, raw, compression: str | None):
        super().__init__()
        self.path, self.compression = path, compression
        self._raw = raw
        self._blocks = _blocks(raw, compression)
        self._pending = memoryview(b"")
        self._total = 0  # decompressed bytes produced so far
        self._finished = False

    def readable(self) -> bool:
        return True

    @property
    def compressed_position(self) -> int:
        """Bytes of the file itself consumed so far (for progress bars)."""
        return self._raw.tell()

    def readinto(self, buffer) -> int:
        while not len(self._pending):
            if self._finished:
                return 0
            block = self._next_block()
            if block is None:
                self._finished = True
                if self._total == 0 and self.compression is not None:
                    raise DataError(
                        f"{self.path}: empty: {_a(self.compression)} file that decompresses to 0 bytes, "
                        f"so there is nothing to read; remove it or recompress the data"
                    )
                return 0
            self._pending = memoryview(block)
            self._total += len(block)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _next_block(self) -> bytes | None:
        try:
            return next(self._blocks, None)
        except EOFError:
            raise DataError(
                f"{self.path}: truncated: the {self.compression} data stops before its end marker, after "
                f"{self._total:,} bytes of content; the rest is missing (an interrupted download or copy?). "
                f"Fetch or recompress the file"
            ) from None
        except _DECOMPRESSION_ERRORS as e:
            what = f"corrupt {self.compression} data" if self.compression else "cannot read"
            raise DataError(
                f"{self.path}: {what} after {self._total:,} bytes of content ({e}); fetch or recompress the file"
            ) from None

    def close(self) -> None:
        if not self.closed:
            self._blocks.close()
            self._raw.close()
        super().close()


def open_decompressed(path: str | os.PathLike, *, buffer_size: int = io.DEFAULT_BUFFER_SIZE) -> io.BufferedReader:
    """``path``'s decompressed content as a binary file; reads raise :class:`DataError` on a truncated,
    corrupt or empty compressed file, and opening does on a missing or unreadable one."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"input not found: {path}" if not os.path.exists(path) else f"input is not a file: {path}")
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        head = raw.read(6)
        raw.seek(0)
        detected = next((name for magic, name in MAGIC if head.startswith(magic)), None)
        claimed = claimed_format(path)
        if claimed and not head:
            raise DataError(
                f"{path}: empty (0 bytes): named like {_a(claimed)} file but holds nothing, not even "
                f"its header (an interrupted download or copy?); fetch or recompress the file"
            )
        if claimed and detected is None:
            raise DataError(
                f"{path}: named like {_a(claimed)} file but is not {claimed}-compressed "
                f"(it starts with {head!r}); rename it or recompress it"
            )
    except OSError as e:
        raw.close()
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    except BaseException:
        raw.close()
        raise
    return io.BufferedReader(DecompressedFile(path, raw, detected), buffer_size)


def check_readable(path: str | os.PathLike) -> None:
    """Fail now, naming the file, if ``path`` is missing, unreadable or misnamed (its content is not read)."""
    open_decompressed(path).close()


def _a(compression: str) -> str:
    return f"an {compression}" if compression == "xz" else f"a {compression}"


def _blocks(raw, compression: str | None) -> Generator[bytes, None, None]:
    """The file's content, decompressed, in blocks; a stream that stops early raises ``EOFError``."""
    if compression is None:
        yield from iter(lambda: raw.read(DECOMPRESSED_BLOCK_BYTES), b"")
        return
    if compression in ("gzip", "xz"):  # both read every member/stream and raise EOFError when cut short
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if compression == "gzip" else lzma.LZMAFile(raw)
        with stream:  # read1: each block as soon as it is decompressed, so errors say how far reading got
            yield from iter(lambda: stream.read1(DECOMPRESSED_BLOCK_BYTES), b"")
        return
    # zstd, frame by frame: zstandard's stream_reader reads a cut frame as a clean end of file.
    frame, read_any = None, False  # read_any: some content came out, or a frame ended
    for block in iter(lambda: raw.read(RAW_READ_BYTES), b""):
        while block:
            frame = frame or zstandard.ZstdDecompressor().decompressobj()
            out = frame.decompress(block)
            if out:
                read_any = True
                yield out
            block, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
            read_any = read_any or frame is None
    if frame is None:
        return
    if not read_any:  # the first frame never ended and gave nothing: cut short, or no zstd data at all?
        raw.seek(0)
        if not _zstd_cut_inside_a_block(raw.read(ZSTD_HEAD_BYTES)):
            raise _NotZstd("no zstd block holding data follows its magic number: not zstd data")
    raise EOFError("the file ends inside a zstd frame")


def _zstd_cut_inside_a_block(head: bytes) -> bool:
    """Whether ``head``, the start of a zstd frame that never ends, stops inside a block holding data,
    as a cut file does. Garbage that the decompressor accepts ends instead inside the frame header or
    a block header, or holds nothing but empty blocks, which no compressor writes (RFC 8878, 3.1.1)."""
    try:
        position = zstandard.frame_header_size(head)
    except zstandard.ZstdError:
        return False
    while position + 3 <= len(head):
        header = int.from_bytes(head[position : position + 3], "little")
        size = header >> 3
        stored = 1 if (header >> 1) & 3 == 1 else size  # an RLE block stores one byte, repeated size times
        if position + 3 + stored > len(head):
            return size > 0
        position += 3 + stored
    return False
