"""Benchmarks: latency, offline throughput, KV waste, a random-weight model maker, and the
renderer of docs/performance.md. Every run prints a short table and writes one JSON file to
benchmarks/results/ (see benchmarks/results.py and docs/benchmarks.md). None of this is a test:
no test asserts a time.
"""
