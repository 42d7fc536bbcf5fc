//! Feeds of committed events for the runs someone follows (`StreamEvents` with `follow`).
//!
//! The write lanes publish every event they commit, in commit order per run, right after the
//! commit and before anyone is answered — whether or not the appending caller is still there.
//! A follower that has caught up from the database takes events from its run's feed instead of
//! reading each one back. A feed exists only while a stream follows the run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use warden_core::chain::ChainedEvent;

/// Events published to a run's followers that a slow follower may fall behind by before it
/// reads the rest from the database.
pub const FOLLOW_BUFFER: usize = 256;

pub type Feed = broadcast::Receiver<Arc<ChainedEvent>>;

#[derive(Default)]
pub struct Followers {
    feeds: Mutex<HashMap<String, broadcast::Sender<Arc<ChainedEvent>>>>,
}

impl Followers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<Arc<ChainedEvent>>>> {
        self.feeds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The run's feed of committed events, from now on.
    pub fn follow(&self, run_id: &str) -> Feed {
        self.lock().entry(run_id.to_string()).or_insert_with(|| broadcast::channel(FOLLOW_BUFFER).0).subscribe()
    }

    /// Drops the run's feed once no stream follows it any more (call after dropping the
    /// stream's own receiver).
    pub fn unfollow(&self, run_id: &str) {
        let mut feeds = self.lock();
        if feeds.get(run_id).is_some_and(|f| f.receiver_count() == 0) {
            feeds.remove(run_id);
        }
    }

    /// Publishes what one group appended (events of one run, in order) if anyone follows the
    /// run; repeats of earlier events were published when they were first committed.
    pub fn publish(&self, appended: &[(Arc<ChainedEvent>, bool)]) {
        let mut fresh = appended.iter().filter(|(_, repeat)| !repeat).map(|(e, _)| e).peekable();
        let Some(first) = fresh.peek() else { return };
        let Some(feed) = self.lock().get(&first.body.run_id).cloned() else { return };
        for e in fresh {
            if feed.receiver_count() == 0 {
                return;
            }
            let _ = feed.send(Arc::clone(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_core::chain::{EventBody, GENESIS_HASH, link};

    fn event(seq: u64) -> Arc<ChainedEvent> {
        let body = EventBody {
            run_id: "r".into(),
            seq,
            event_type: "run_started".into(),
            payload: serde_json::json!({}),
            step_id: String::new(),
            epoch: 1,
            idempotency_key: format!("k{seq}"),
            timestamp_ms: 0,
        };
        Arc::new(link(body, GENESIS_HASH))
    }

    #[test]
    fn a_feed_lives_while_followed_and_carries_events_in_order() {
        let followers = Followers::default();
        followers.publish(&[(event(1), false)]);
        let mut feed = followers.follow("r");
        followers.publish(&[(event(2), false), (event(1), true), (event(3), false)]);
        assert_eq!(feed.try_recv().expect("2").body.seq, 2);
        assert_eq!(feed.try_recv().expect("3").body.seq, 3);
        assert!(feed.try_recv().is_err(), "nothing from before the follow, no repeat");
        followers.unfollow("r");
        assert_eq!(followers.lock().len(), 1, "still followed");
        drop(feed);
        followers.unfollow("r");
        assert!(followers.lock().is_empty(), "gone with its last follower");
    }
}
