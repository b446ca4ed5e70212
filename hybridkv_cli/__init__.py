"""hybridkv: answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget."""

from hybridkv_cli.api import ask
from hybridkv_cli.media import load_media
from hybridkv_cli.models import load_model

__all__ = ["ask", "load_media", "load_model"]
