"""terapipe-plan, the planner's command line, and what it prints.

command.py: the command (`main`, `build_parser`); arguments.py: its options into PlannerInputs;
report.py: the plan and schedule tables in text; timeline.py: predicted timelines as Chrome
traces and pictures.

May import: plan, schedule, planner
"""
