"""Run a DisaggServing as processes on one machine, from the plan the operator renders."""
