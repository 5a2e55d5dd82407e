-- graph keeps its state in the graph store (FalkorDB), checkpoints included
-- (docs/adr/0030). Its database holds only the reliability tables, which
-- every service has: no table of its own.
SELECT 1;
