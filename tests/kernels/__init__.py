"""Tests of the paged-KV attention and cache kernels."""
