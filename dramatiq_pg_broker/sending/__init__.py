"""The send path: a message becomes a job row, written through the pool, the
application's transaction (sync or asyncio), or a batch."""
