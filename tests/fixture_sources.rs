//! Every reference fixture under `tests/fixtures/` names the files it was made from — the
//! reference, its fixture maker, the shipped model it read — with their SHA-256
//! (`tools/reference/sources.py`). A file edited after its fixture was written fails here, so a
//! reference cannot drift from the fixtures that claim to be its output (CI runs no Python).

use sha2::{Digest, Sha256};
use std::path::Path;

#[test]
fn fixtures_were_made_from_the_files_they_name() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(root.join("tests/fixtures")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let sources = doc["sources"].as_object().unwrap_or_else(|| panic!("{name}: no `sources`; make it again with its maker in tools/reference/"));
        assert!(sources.keys().any(|p| p.starts_with("tools/reference/")), "{name}: no reference among its sources");
        for (file, want) in sources {
            let bytes = std::fs::read(root.join(file)).unwrap_or_else(|e| panic!("{name}: source {file}: {e}"));
            let got: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(&got, want, "{name}: {file} changed after the fixture was made; make the fixture again (tools/reference/)");
        }
        checked += 1;
    }
    assert!(checked >= 7, "{checked} fixtures");
}
