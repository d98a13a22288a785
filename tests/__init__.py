"""pagedserve test suite."""
