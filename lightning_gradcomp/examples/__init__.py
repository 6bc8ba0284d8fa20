"""Small, real, offline models and data modules used by the recipes, the tests and the benchmarks."""
