"""Operator control: queue pauses and concurrency limits, the worker registry."""
