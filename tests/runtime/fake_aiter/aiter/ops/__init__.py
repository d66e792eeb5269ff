from aiter.ops import shuffle

__all__ = ["shuffle"]
