-- An ordered consumer rewrites its aggregate's position row with every
-- event it applies (docs/adr/0028). Room left in each page lets that
-- update stay on the page (a HOT update: no new index entry).
ALTER TABLE aggregate_positions SET (fillfactor = 50);
