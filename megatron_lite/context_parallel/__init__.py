"""Context parallelism: the sequence split across ranks, with ring, all-to-all or all-gather attention."""
