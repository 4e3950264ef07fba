"""Keeping long jobs alive and making their failures explain themselves: preemption-safe exits, NaN and
loss-spike policies, a flight recorder of collectives that turns a hang into a report, straggler reports
and the fault-injection hooks the tests use."""
