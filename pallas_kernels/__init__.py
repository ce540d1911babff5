"""Ragged paged attention: a pure-JAX reference that defines correctness (Pallas kernels come later)."""

from pallas_kernels.reference import ragged_paged_attention_ref, write_kv_ref

__all__ = ["ragged_paged_attention_ref", "write_kv_ref"]
