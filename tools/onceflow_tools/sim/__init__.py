"""Deterministic simulation of onceflow: the server, its disk, the network and the clients in one
process, on simulated time, driven by a seed (``onceflow sim``; docs/reliability.md)."""
