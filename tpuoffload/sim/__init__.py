"""Simulation of a serving engine on CPU: vLLM's real scheduler, synthetic runners, and the connector.

Used by the demo and the tests; nothing here is needed in production.
"""
