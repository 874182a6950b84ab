"""The gateway's service: settings, runtime, the engine thread, the request pipeline, the prompter, the accuracy
guard, metrics and logs. Nothing here knows HTTP: refusals are domain errors (errors.py) that app/http maps."""
