"""The CPU wing: verl's real trainer and vLLM's CPU build on a machine without a GPU (docs/cpu.md:
how it plugs in, and that the recipe's core never imports it). Importing this package imports nothing else.
"""
