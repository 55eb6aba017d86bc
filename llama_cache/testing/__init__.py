"""Helpers for llama-cache's own test suite (tiny random-weight models of the recurrent and hybrid architectures)."""
