"""Planning: cost models, the DP slicer and the schedule simulator (numpy only)."""
