"""History and maintenance: the history partitions' probe, retention, and the schedules
(the scheduler middleware). It imports the database plumbing and the base modules."""
