"""Data preparation for STAPO: DAPO-Math-17k and the six math benchmarks as verl parquet files."""
