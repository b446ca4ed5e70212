"""File checks and content sniffing: is it there, is it readable, and what do its first bytes say."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hybridkv_cli.io.errors import MediaError
from hybridkv_cli.io.user_files import stat_checked


def lstat_checked(path: Path, shown: str) -> os.stat_result:
    """stat() a path (following links), turning every failure into a one-line MediaError (the
    one path check of user files, :func:`hybridkv_cli.io.user_files.stat_checked`)."""
    return stat_checked(path, MediaError, shown)


def _open_binary(path: Path):  # indirection point for tests (root ignores permission bits)
    return open(path, "rb")


def check_file(path: Path, shown: str) -> bytes:
    """Existence / type / size / readability; returns the first 64 bytes for sniffing."""
    st = lstat_checked(path, shown)
    if stat.S_ISDIR(st.st_mode):
        raise MediaError("is a directory, expected a file", source=shown)
    if not stat.S_ISREG(st.st_mode):
        raise MediaError("not a regular file", source=shown)
    if st.st_size == 0:
        raise MediaError("empty file (0 bytes)", source=shown)
    try:
        with _open_binary(path) as f:
            return f.read(64)
    except PermissionError:
        raise MediaError("permission denied (file is not readable)", source=shown) from None
    except OSError as e:
        raise MediaError(f"cannot read: {e.strerror or e}", source=shown) from None


def sniff(head: bytes) -> tuple[str, str] | None:
    """Guess (kind, description) from magic bytes; kind in {"image", "video", "audio", "text", "other"}."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "a PNG image"
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "a JPEG image"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "a GIF image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "a WebP image"
    if head[:2] == b"BM":
        return "image", "a BMP image"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "image", "a TIFF image"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return "audio", "an MPEG-4 audio file"
        if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
            return "image", "a HEIF/AVIF image"
        return "video", "an MP4/MOV video"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "video", "a Matroska/WebM video"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "an AVI video"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "audio", "a WAV audio file"
    if head[:3] == b"ID3" or head[:4] in (b"fLaC", b"OggS"):
        return "audio", "an audio file"
    if head[:5] == b"%PDF-":
        return "other", "a PDF document"
    if head[:4] == b"PK\x03\x04":
        return "other", "a ZIP archive"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        try:  # a multi-byte character may be cut at byte 64
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return None
    if text and all(c.isprintable() or c in "\r\n\t\f" for c in text):
        return "text", "text"
    return None


def one_line(e: BaseException | str) -> str:
    if isinstance(e, BaseException) and isinstance(getattr(e, "strerror", None), str) and e.strerror:
        msg = e.strerror  # PyAV / OSError: drop the "[Errno N]" prefix and the C function name
    else:
        msg = str(e)
    msg = " ".join(msg.split())
    if not msg:
        msg = type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."
