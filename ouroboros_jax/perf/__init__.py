"""Speed and memory: measured (`bench`, `memory`) and predicted (`simulate`)."""
