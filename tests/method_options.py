"""Options a method needs to be built at all in the shared test matrices (most need none)."""

# route: a pattern of three methods repeated over the layers (a route file is tested in
# tests/test_route.py).
NEEDED = {"route": {"route": "hybridkv,snapkv,streamingllm"}}


def needed(name: str) -> dict:
    return dict(NEEDED.get(name, {}))
