"""Re-exports of ``tensorswap.transport``: the Transport interface and in-memory pairs."""

from tensorswap.transport.base import Transport, byte_view
from tensorswap.transport.memory import MemoryTransport, memory_pair

__all__ = ["MemoryTransport", "Transport", "byte_view", "memory_pair"]
