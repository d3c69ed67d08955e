-- 0008: claims abandoned before a start was recorded.
--
-- A worker records an attempt's start a moment after its actor began, batched with the
-- other starts of that moment, unless an outcome came first (most short jobs): recording
-- every start before its actor ran cost one statement and one row version per job. A job
-- whose lease then expires with no start recorded went back uncharged (its worker died
-- with the message prefetched, or while the actor had only just begun); this column counts
-- those returns. A job with any has every later start recorded before its actor runs, so
-- a message that kills its worker at once is charged an interruption from its second claim
-- on, and still ends failed once its interruptions reach their bound.

ALTER TABLE jobs
    ADD COLUMN abandoned_claims integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT jobs_abandoned_claims_in_range CHECK (abandoned_claims >= 0);
