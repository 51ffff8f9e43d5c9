"""What the Faust workers (trajectories, groups) share: the app's settings and start, the consumer, table
changelogs, the state folder, the health page and dead letters."""
