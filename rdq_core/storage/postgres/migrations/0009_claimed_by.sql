-- rdq schema v9: who holds a running task's claim.
--
-- A claim stores the claimer's name (rdq worker: host, pid and name; a Lambda worker: function,
-- log stream and request id) beside claimed_at, in the claim's own UPDATE; NULL when the claimer
-- gave none. The console's task page and `rdq task show` read it while the task is in flight.
-- Additive: a column that may be NULL, with no default and no index, so adding it rewrites
-- nothing and takes only a brief lock; workers of the previous version keep claiming and leave
-- it empty.
ALTER TABLE rdq_tasks ADD COLUMN claimed_by text;
