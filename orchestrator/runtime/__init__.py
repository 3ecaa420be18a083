"""Running a job: join the cluster, reserve placement, start the rank actors, drive the step loop (the controller)."""
