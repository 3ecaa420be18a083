"""Fault injection on the controller side: the job file's fault schedule, soak repetition, disk corruption."""
