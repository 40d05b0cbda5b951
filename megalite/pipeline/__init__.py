"""Pipeline parallelism: stages, schedules, point-to-point exchange, the pipelined step."""
