//! The directories checkpoints may be read from. Every file of a checkpoint (its
//! `config.json`, its index and every shard the index names) is resolved, symlinks and all,
//! and must lie under one of them: a shard that is a symlink to a file elsewhere is refused
//! like a checkpoint directory elsewhere.

use std::path::{Component, Path, PathBuf};

/// Why a path was refused.
#[derive(Debug, thiserror::Error)]
pub enum RootsError {
    /// An allowed root that cannot be resolved (it must exist).
    #[error("allowed root {path}: {source}")]
    Root { path: PathBuf, source: std::io::Error },
    #[error("checkpoint path {path}: `..` is not allowed in checkpoint paths")]
    DotDot { path: PathBuf },
    #[error("checkpoint path {path}: {source}")]
    Unresolvable { path: PathBuf, source: std::io::Error },
    #[error("checkpoint path {path}: no allowed roots (a worker without --allow-root reads no checkpoint directories)")]
    NoRoots { path: PathBuf },
    #[error("checkpoint path {path}: resolves to {resolved}, outside the allowed roots ({})", list(roots))]
    Outside { path: PathBuf, resolved: PathBuf, roots: Vec<PathBuf> },
}

fn list(roots: &[PathBuf]) -> String {
    roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
}

impl RootsError {
    /// The path that was refused (as given, not as resolved).
    pub fn path(&self) -> &Path {
        match self {
            RootsError::Root { path, .. }
            | RootsError::DotDot { path }
            | RootsError::Unresolvable { path, .. }
            | RootsError::NoRoots { path }
            | RootsError::Outside { path, .. } => path,
        }
    }
}

/// The directories checkpoints may be read from (canonical paths).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowedRoots(Vec<PathBuf>);

impl AllowedRoots {
    /// Canonicalizes each root (each must exist).
    pub fn new(roots: &[PathBuf]) -> Result<Self, RootsError> {
        roots
            .iter()
            .map(|r| r.canonicalize().map_err(|source| RootsError::Root { path: r.clone(), source }))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// The roots that let exactly one checkpoint directory be read: for a directory inside a
    /// Hugging Face hub cache snapshot (`.../models--ORG--NAME/snapshots/REV[/...]`, whose
    /// files are symlinks to `../../blobs/HASH`), its repository folder `models--ORG--NAME`;
    /// for any other directory, the directory itself. `..` is refused; the directory must
    /// exist.
    pub fn for_checkpoint(dir: &Path) -> Result<Self, RootsError> {
        if has_dotdot(dir) {
            return Err(RootsError::DotDot { path: dir.to_path_buf() });
        }
        let canonical = dir.canonicalize().map_err(|source| RootsError::Root { path: dir.to_path_buf(), source })?;
        Ok(Self(vec![hub_repo_of(&canonical).unwrap_or(canonical)]))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The canonical roots.
    pub fn roots(&self) -> &[PathBuf] {
        &self.0
    }

    /// The canonical path, if it lies under an allowed root: a path with `..` is refused
    /// outright, and symlinks are resolved before the check, so none can escape.
    pub fn check(&self, path: &Path) -> Result<PathBuf, RootsError> {
        if has_dotdot(path) {
            return Err(RootsError::DotDot { path: path.to_path_buf() });
        }
        let canonical = path.canonicalize().map_err(|source| RootsError::Unresolvable { path: path.to_path_buf(), source })?;
        self.admit(path, canonical)
    }

    /// Like [`AllowedRoots::check`] for a file a checkpoint names: `Ok(None)` when it does not
    /// exist (nothing can be read from it; the reader reports it missing in its own words).
    pub fn check_file(&self, path: &Path) -> Result<Option<PathBuf>, RootsError> {
        if has_dotdot(path) {
            return Err(RootsError::DotDot { path: path.to_path_buf() });
        }
        match path.canonicalize() {
            Ok(canonical) => self.admit(path, canonical).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(RootsError::Unresolvable { path: path.to_path_buf(), source }),
        }
    }

    fn admit(&self, path: &Path, canonical: PathBuf) -> Result<PathBuf, RootsError> {
        if self.0.iter().any(|root| canonical.starts_with(root)) {
            Ok(canonical)
        } else if self.0.is_empty() {
            Err(RootsError::NoRoots { path: path.to_path_buf() })
        } else {
            Err(RootsError::Outside { path: path.to_path_buf(), resolved: canonical, roots: self.0.clone() })
        }
    }
}

fn has_dotdot(path: &Path) -> bool {
    path.components().any(|c| c == Component::ParentDir)
}

/// The `models--ORG--NAME` folder of a canonical path inside one of its snapshots.
fn hub_repo_of(canonical: &Path) -> Option<PathBuf> {
    canonical.ancestors().find_map(|revision| {
        let snapshots = revision.parent()?;
        let repo = snapshots.parent()?;
        let is_repo = repo.file_name()?.to_str()?.starts_with("models--");
        (snapshots.file_name()? == "snapshots" && is_repo && revision.file_name().is_some()).then(|| repo.to_path_buf())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_repo_folders() {
        let p = Path::new("/c/models--org--name/snapshots/abc");
        assert_eq!(hub_repo_of(p), Some(PathBuf::from("/c/models--org--name")));
        assert_eq!(hub_repo_of(&p.join("sub")), Some(PathBuf::from("/c/models--org--name")));
        assert_eq!(hub_repo_of(Path::new("/c/models--org--name/snapshots")), None);
        assert_eq!(hub_repo_of(Path::new("/c/models--org--name")), None);
        assert_eq!(hub_repo_of(Path::new("/c/datasets--x/snapshots/abc")), None);
        assert_eq!(hub_repo_of(Path::new("/c/ckpt")), None);
    }

    #[test]
    fn roots_refuse_dotdot_and_escapes() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let inside = root.join("ckpt");
        std::fs::create_dir_all(&inside).unwrap();
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        assert_eq!(roots.check(&inside).unwrap(), inside.canonicalize().unwrap());
        assert!(matches!(roots.check(&root.join("ckpt/../ckpt")), Err(RootsError::DotDot { .. })));
        assert!(matches!(roots.check(tmp.path()), Err(RootsError::Outside { .. })));
        assert!(matches!(AllowedRoots::default().check(&inside), Err(RootsError::NoRoots { .. })));
        assert_eq!(roots.check_file(&inside.join("absent")).unwrap(), None);
        assert!(matches!(AllowedRoots::new(&[tmp.path().join("nope")]), Err(RootsError::Root { .. })));
        assert_eq!(AllowedRoots::for_checkpoint(&inside).unwrap().roots(), &[inside.canonicalize().unwrap()]);
        assert!(matches!(AllowedRoots::for_checkpoint(&root.join("ckpt/../ckpt")), Err(RootsError::DotDot { .. })));
        // A link inside a root that leads out of it is judged by where it resolves.
        #[cfg(unix)]
        {
            let outside = tmp.path().join("elsewhere");
            std::fs::create_dir_all(&outside).unwrap();
            let link = root.join("escape");
            std::os::unix::fs::symlink(&outside, &link).unwrap();
            let e = roots.check(&link).unwrap_err();
            assert!(matches!(e, RootsError::Outside { .. }), "{e:?}");
            assert!(e.to_string().contains("outside the allowed roots"), "{e}");
        }
    }
}
