"""Strategy search, one job a module: `dataflow` (uses, gradients, what the backward keeps), `memory`,
`costing` (fills the arrays), `problem` (the frozen costed problem), `repeats` (finding repeated
blocks), `fold` (solving them), `dp`
(elimination), `ilp` (the exact cross-check) and `driver` (modes, the memory walk; owns the solver)."""
