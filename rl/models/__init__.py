"""Model builders and model code: tiny test models (`tiny`), Muse Spark Open (`muse/`)."""
