"""Named tfdp strategy presets, one YAML file each (installed as ``tfdp.preset_files``)."""
