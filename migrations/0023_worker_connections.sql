-- compatibility: compatible
-- One nullable column on the small workers table: earlier releases keep registering (their rows leave it empty) and never read it.
--
-- 0023: each worker process records its connection budget.
--
-- A worker process opens at most its pool's `pool_max_size` connections, one LISTEN
-- connection (none with `listen` off) and, while it runs maintenance, the connection that
-- holds the run's turn at the partition steps, whatever its threads and queues: its
-- connection budget, which it writes into its registry row with every beat. `dramatiq-pg-broker
-- doctor` adds the budgets of the live workers up against the server's
-- `max_connections`, so that a deployment learns that its next scale-out would run the
-- server out of slots before it does. Rows of processes of earlier releases leave it
-- NULL (doctor counts them at the default budget).
--
-- Locking and duration: adding a nullable column without a default is a catalog change
-- only, under a brief ACCESS EXCLUSIVE lock on workers, which only the workers' beats
-- (one statement per process per heartbeat interval) and the registry's readers touch.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE workers
    ADD COLUMN connections integer
        CONSTRAINT workers_connections_not_negative CHECK (connections >= 0);
