"""The parallelism planner: which layouts of a model fit a cluster, their memory per GPU, and a cost model
of their step time (tools/plan_parallelism.py is the command line)."""
