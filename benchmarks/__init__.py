"""Side-by-side benchmarks of this broker against Dramatiq's Redis and RabbitMQ brokers.

Run ``python -m benchmarks.run --help`` (or ``make bench``); see ``benchmarks/README.md``.
"""
