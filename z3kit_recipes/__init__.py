"""Runtimes composed from z3kit primitives; ``zero3`` is the stock one."""
