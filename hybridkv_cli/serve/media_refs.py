"""``image_url`` / ``video_url`` parts resolved to media bytes, safely.

* ``data:`` URLs (base64) are always taken.
* Local files -- a plain path or a ``file://`` URL -- only under ``--allowed-media-dir``: the path
  is resolved with ``realpath`` (``..`` and symlinks followed) and must stay inside the directory's
  own real path; the file is then opened without following a link, must be a regular file (never
  a FIFO or device: nothing blocks) and is read whole, bounded.
* Anything else (``http(s)://``, ``ftp://``, ...) is refused: the server fetches nothing remote.

Every ref is sniffed by its magic bytes: an ``image_url`` must be an image, a ``video_url`` a
video, or the request is a 400 naming what it looks like. The bytes (with their SHA-256) are what
the prefix cache is keyed by, and what the worker decodes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from hybridkv_cli.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from hybridkv_cli.media.sniff import sniff
from hybridkv_cli.serve.errors import ApiError, bad_request
from hybridkv_cli.serve.settings import ServeSettings

#: The media types a ``data:`` URL may name, and the file suffix the media loader reads them by.
DATA_TYPES = {
    "image/png": ".png", "image/apng": ".apng", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/gif": ".gif",
    "image/webp": ".webp", "image/bmp": ".bmp", "image/tiff": ".tiff", "video/mp4": ".mp4",
    "video/quicktime": ".mov", "video/x-msvideo": ".avi", "video/avi": ".avi", "video/x-matroska": ".mkv",
    "video/webm": ".webm",
}
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII | re.IGNORECASE)


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a request: its bytes, the suffix it is decoded by, and its label."""

    kind: str  # "image" | "video"
    data: bytes
    suffix: str
    label: str  # what the client sent, shortened (data: URLs by their type and size)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def resolve_all(media: tuple[tuple[str, str], ...], settings: ServeSettings) -> list[MediaRef]:
    """Every ``(kind, url)`` of a request resolved, their bytes together within ``max_media_bytes``."""
    refs, total = [], 0
    for index, (kind, url) in enumerate(media):
        ref = resolve(kind, url, settings, settings.max_media_bytes - total, f"messages[0].content[{index}]")
        total += len(ref.data)
        refs.append(ref)
    return refs


def resolve(kind: str, url: str, settings: ServeSettings, room: int, param: str) -> MediaRef:
    """One ref's bytes (``room``: the most bytes it may have), checked to be a ``kind``."""
    scheme = urlsplit(url).scheme.lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", url) else ""
    if scheme == "data":
        data, suffix, label = _data_url(url, room, param)
    elif scheme in ("", "file"):
        data, suffix, label = _local_file(url, scheme, settings, room, param)
    else:
        raise bad_request(f"{scheme}: URLs are not fetched; send the media as a data: URL (or a file under the "
                          "server's --allowed-media-dir)", param, "unsupported_url")
    looks = sniff(data[:64])
    if looks is None or looks[0] != kind:
        what = looks[1] if looks else "not a known image or video format"
        raise bad_request(f"{label}: a {kind}_url must be {'an image' if kind == 'image' else 'a video'}; this is "
                          f"{what}", param, "invalid_media")
    return MediaRef(kind, data, suffix, label)


def _data_url(url: str, room: int, param: str) -> tuple[bytes, str, str]:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise bad_request("a data: URL must be data:<type>;base64,<data>", param, "invalid_media")
    media_type = (m.group("type") or "").lower()
    if media_type not in DATA_TYPES:
        raise bad_request(f"data: URL of type '{media_type or 'none'}'; give an image or video type (e.g. "
                          "image/png, video/mp4)", param, "invalid_media")
    encoded = url[m.end():]
    if len(encoded) // 4 * 3 > room:
        raise _too_large(room, param)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data: URL is not valid base64", param, "invalid_media") from None
    if not data:
        raise bad_request("the data: URL is empty", param, "invalid_media")
    return data, DATA_TYPES[media_type], f"data:{media_type} ({len(data)} bytes)"


def _local_file(url: str, scheme: str, settings: ServeSettings, room: int, param: str) -> tuple[bytes, str, str]:
    if settings.allowed_media_dir is None:
        raise bad_request("local files are not served (the server has no --allowed-media-dir); send the media as a "
                          "data: URL", param, "file_not_allowed")
    path = url
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise bad_request("a file: URL must be file:///absolute/path", param, "file_not_allowed")
        path = unquote(parts.path)
    if not path or "\0" in path:
        raise bad_request("empty or invalid file path", param, "file_not_allowed")
    root = os.path.realpath(settings.allowed_media_dir)
    real = os.path.realpath(os.path.join(root, path))  # a relative path is relative to the directory
    if os.path.commonpath([root, real]) != root:
        raise bad_request(f"{url}: outside the server's --allowed-media-dir", param, "file_not_allowed")
    suffix = os.path.splitext(real)[1].lower()
    if suffix not in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
        raise bad_request(f"{url}: not a media file name (an image or video suffix)", param, "invalid_media")
    try:  # O_NOFOLLOW: a link swapped in after the check is not followed; O_NONBLOCK: a FIFO cannot block
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ApiError(404 if isinstance(e, FileNotFoundError) else 400, f"{url}: {e.strerror or 'cannot open'}",
                       param=param, code="file_not_found" if isinstance(e, FileNotFoundError) else "file_not_allowed"
                       ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise bad_request(f"{url}: not a regular file", param, "invalid_media")
        if st.st_size > room:
            raise _too_large(room, param)
        data = f.read(room + 1)
    if len(data) > room:
        raise _too_large(room, param)
    if not data:
        raise bad_request(f"{url}: empty file", param, "invalid_media")
    return data, suffix, url if len(url) <= 200 else url[:197] + "..."


def _too_large(room: int, param: str) -> ApiError:
    return ApiError(413, f"the request's media is over the server's limit ({room} bytes left of --max-media-bytes)",
                    param=param, code="media_too_large")
