"""The worker's attempt: claims, the in-flight ledger, leases, outcomes, retries, skips
and the current job."""
