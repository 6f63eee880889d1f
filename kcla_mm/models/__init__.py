"""Models built on the host libraries (backbones, decode heads)."""
