"""Strategy search: the problem (costs), the elimination DP, and the memory-constrained driver."""
