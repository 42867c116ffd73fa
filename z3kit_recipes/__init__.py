"""Runtimes composed from z3kit primitives."""
